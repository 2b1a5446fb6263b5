"""`treeflash serve`: a live server on a loopback port, driven by the official `openai` client.

The server runs in a subprocess over a tiny random-weight Llama (real SmolLM2 tokenizer and chat
template) with a small random drafter, so generation is fast; greedy answers must equal the
engine's own (`engine.generate`, `treeflash generate --json`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

API_KEY = "sk-test-key"
MAX_TOKENS_LIMIT = 64
DEFAULT_MAX_TOKENS = 12
SPEC_ARGS = ["--tree-size", "8", "--top-m", "2", "--top-k", "2"]
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain recursion briefly.", "Say hello in Spanish."]


# ---------------------------------------------------------------- tiny model on disk
def build_tiny_model(out: Path) -> tuple[Path, Path]:
    """A 4-layer random Llama with the real SmolLM2 tokenizer, and a small random drafter."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treeflash.api import random_drafter
    from treeflash.models import registry
    from treeflash.models.target import Target

    src, _ = registry.resolve_target(registry.DEFAULT_TARGET)
    tok = AutoTokenizer.from_pretrained(str(src))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=True, initializer_range=0.3)  # wide init: varied text per prompt
    torch.manual_seed(0)
    target_dir, drafter_dir = out / "target", out / "drafter"
    LlamaForCausalLM(cfg).save_pretrained(str(target_dir))
    tok.save_pretrained(str(target_dir))
    if (src / "chat_template.jinja").exists():
        shutil.copy(src / "chat_template.jinja", target_dir / "chat_template.jinja")
    target = Target.load(str(target_dir))
    random_drafter(target, seed=0, block_size=4).save(drafter_dir, dtype=torch.float32)
    return target_dir, drafter_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    # one torch thread per process: the machine's cores are shared with the test process
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}


class Server:
    def __init__(self, target_dir: Path, drafter_dir: Path, log: Path, extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "treeflash.cli", "serve", "--target", str(target_dir),
               "--drafter", str(drafter_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", API_KEY, "--served-model-name", "tiny", "--max-new-tokens", str(DEFAULT_MAX_TOKENS),
               "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--dtype", "float32", *SPEC_ARGS, *extra]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env())

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-log")
    srv = Server(*model_dirs, log=logs / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def engine(model_dirs):
    """The same target and drafter, in-process: the reference for greedy answers."""
    from treeflash.api import Engine
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target

    target_dir, drafter_dir = model_dirs
    return Engine(Target.load(str(target_dir)), load_drafter(drafter_dir))


def hold_after_text(worker, hold: threading.Event) -> None:
    """While `hold` is set, the worker waits before each step once a running request has sent text,
    until `hold` is cleared or every running client has left (then it skips the step, so that it
    drops them first). Queueing and disconnects are then tested deterministically, whatever the
    machine's speed."""
    step = worker.decoder.step

    def held() -> bool:
        return hold.is_set() and any(a.text.sent for a in list(worker.active.values()))

    def held_step():
        while held() and not all(a.job.cancelled.is_set() for a in list(worker.active.values())):
            time.sleep(0.01)
        return {} if held() else step()

    worker.decoder.step = held_step


@pytest.fixture(scope="module")
def held_server(model_dirs):
    """The server app in this process (uvicorn on a thread) on the hf backend (`SerialDecoder`);
    `.hold` holds its steps (`hold_after_text`)."""
    import types

    from treeflash.api import Engine
    from treeflash.config import GenerationConfig
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.app import create_app
    from treeflash.serve.jobs import ServeConfig

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="hf")
    gen = GenerationConfig(method="treeflash", tree_size=8, top_m=2, top_k=2, max_new_tokens=DEFAULT_MAX_TOKENS)
    app = create_app(engine, ServeConfig(model_name="tiny", generation=gen, max_tokens_limit=MAX_TOKENS_LIMIT,
                                         api_key=API_KEY))
    hold = threading.Event()
    hold_after_text(app.state.worker, hold)
    try:
        with in_process(app) as url:
            yield types.SimpleNamespace(url=url, hold=hold, worker=app.state.worker)
    finally:
        hold.clear()


@contextlib.contextmanager
def in_process(app):
    """Serve `app` with uvicorn on a thread of this process; yields its base URL, stops it after."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=srv.run, name="in-process-server", daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started or not thread.is_alive(), "the in-process server to start", timeout=60)
        assert srv.started, "the in-process server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy(engine, prompt, n=DEFAULT_MAX_TOKENS, **kw):
    return engine.generate(prompt, method="treeflash", max_new_tokens=n, tree_size=8, top_m=2, top_k=2,
                           temperature=0.0, **kw)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def post(server, path: str, body=None, *, raw: bytes | None = None, key: str | None = API_KEY, timeout=120):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def metric(server, name: str, **labels) -> float:
    """The value of one sample on /metrics (0 if absent)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(\{.*\})? (\S+)", line)
        if m and m.group(1) == name and want in (m.group(2) or ""):
            total += float(m.group(3))
    return total


# ---------------------------------------------------------------- routes and answers
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_chat_completion_equals_engine(client, engine):
    want = greedy(engine, user(PROMPTS[0]))
    r = client.chat.completions.create(model="tiny", messages=user(PROMPTS[0]), temperature=0,
                                       max_tokens=DEFAULT_MAX_TOKENS)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if want.stats.finish_reason == "stop" else "length")
    assert r.usage.prompt_tokens == len(engine.target.encode(user(PROMPTS[0])))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.model_extra["mean_acceptance_length"] == pytest.approx(want.stats.mean_acceptance_length,
                                                                          abs=1e-3)


def test_streamed_chat_concatenates_to_non_streamed(client):
    kw = dict(model="tiny", messages=user(PROMPTS[1]), temperature=0, max_tokens=20)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1, "the answer should arrive in several chunks"
    assert "".join(pieces) == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= len(pieces) - 2


def test_completion_equals_engine_without_chat_template(client, engine):
    prompt = "The quick brown fox"
    want = greedy(engine, prompt, n=10, chat=False)
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=10)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    streamed = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


def test_completion_accepts_token_ids(client, engine):
    ids = engine.target.encode("Once upon a time", chat=False)
    want = greedy(engine, ids, n=6)
    r = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=6)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)


def test_chat_completion_equals_treeflash_generate_cli(client, model_dirs):
    target_dir, drafter_dir = model_dirs
    out = subprocess.run([sys.executable, "-m", "treeflash.cli", "generate", PROMPTS[2], "--json",
                          "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "10",
                          "--dtype", "float32", *SPEC_ARGS], capture_output=True, env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    want = json.loads(out.stdout.decode("utf-8"))
    r = client.chat.completions.create(model="tiny", messages=user(PROMPTS[2]), temperature=0, max_tokens=10)
    assert r.choices[0].message.content == want["text"]
    assert r.usage.completion_tokens == len(want["token_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_truncates(client, engine, stream):
    full = greedy(engine, user(PROMPTS[3]), n=20).text
    stop = full[6:9]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    kw = dict(model="tiny", messages=user(PROMPTS[3]), temperature=0, max_tokens=20, stop=[stop])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert text == full[:full.index(stop)]
    assert finish == "stop"


def test_sampling_with_seed_is_reproducible(client):
    kw = dict(model="tiny", messages=user(PROMPTS[4]), temperature=1.0, top_p=0.9, max_tokens=8, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b and a


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 2.0])
def test_extreme_temperatures_answer(client, temperature):
    r = client.completions.create(model="tiny", prompt="Hi", temperature=temperature, max_tokens=3, seed=0)
    assert r.choices[0].text is not None and 1 <= r.usage.completion_tokens <= 3


def test_unknown_fields_are_ignored(server):
    body = {"model": "tiny", "messages": user("hi"), "max_tokens": 2, "frequency_penalty": 0.5, "user": "u1",
            "logit_bias": {"1": 2}, "some_future_field": {"x": [1, 2]}}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


# ---------------------------------------------------------------- concurrency and aborts
def test_concurrent_streams_get_their_own_answers(server, engine):
    want = {p: greedy(engine, user(p), n=10).text for p in PROMPTS}
    got, errors = {}, []

    def ask(p: str) -> None:
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
            stream = c.chat.completions.create(model="tiny", messages=user(p), temperature=0, max_tokens=10,
                                               stream=True)
            got[p] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(f"{p}: {e!r}")

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == want
    assert len(set(want.values())) == len(PROMPTS), "prompts should give distinct answers"


def wait_until(cond, what: str, timeout: float = 120) -> None:
    """Poll `cond()` until it holds (a bound against a hang, not a timing assumption)."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def load(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def test_hf_backend_serves_one_request_at_a_time(held_server, engine):
    """The hf backend (which `BatchDecoder` cannot run) serves through `SerialDecoder`, the engine's
    single-sequence loop: greedy answers equal `Engine.generate`'s."""
    from treeflash.decoding.serial import SerialDecoder

    assert isinstance(held_server.worker.decoder, SerialDecoder)
    want = greedy(engine, user(PROMPTS[2]))
    r = post(held_server, "/v1/chat/completions", {"messages": user(PROMPTS[2]), "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)


def test_queue_is_first_in_first_out(held_server):
    """A is held after its first text until B and C are both queued behind it."""
    server = held_server
    done: list[str] = []

    def ask(name: str, n: int) -> None:
        r = post(server, "/v1/chat/completions", {"messages": user(f"request {name}"), "max_tokens": n})
        done.append(name if r.status_code == 200 else f"{name}:{r.status_code}")

    server.hold.set()
    threads = []
    try:
        threads.append(threading.Thread(target=ask, args=("A", MAX_TOKENS_LIMIT)))
        threads[-1].start()
        wait_until(lambda: load(server)["running"] == 1, "A to start")
        for n_waiting, name in enumerate("BC", 1):
            threads.append(threading.Thread(target=ask, args=(name, 2)))
            threads[-1].start()
            wait_until(lambda: load(server)["waiting"] == n_waiting, f"{name} to be queued")
        assert load(server)["running"] == 1 and done == [], "A finished while held"
    finally:
        server.hold.clear()
    for t in threads:
        t.join(timeout=300)
    assert done == ["A", "B", "C"]


def _wait_for_abort(server, before: float, timeout: float = 30) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = metric(server, "vllm:request_success_total", finished_reason="abort")
        if now > before:
            return now
        time.sleep(0.2)
    return metric(server, "vllm:request_success_total", finished_reason="abort")


def test_client_abort_mid_stream_stops_generation(held_server):
    """The generation is held after its first text; the client leaves mid-stream and the worker
    stops it (an abort, fewer tokens than asked), then serves the next request."""
    server = held_server
    aborts = metric(server, "vllm:request_success_total", finished_reason="abort")
    tokens_before = metric(server, "vllm:generation_tokens_total")
    body = {"model": "tiny", "messages": user(PROMPTS[0]), "max_tokens": MAX_TOKENS_LIMIT, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    server.hold.set()  # the generation pauses after its first text: the client leaves mid-stream
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=60) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]
        assert _wait_for_abort(server, aborts) == aborts + 1, "the aborted generation was not stopped"
    finally:
        server.hold.clear()
    assert metric(server, "vllm:generation_tokens_total") - tokens_before < MAX_TOKENS_LIMIT
    r = post(server, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(server.url + "/health", timeout=10).json()["running"] == 0


def test_client_timeout_on_non_streamed_request_frees_worker(held_server):
    """The request is held after its first text until its client times out: the generation ends as
    an abort and the worker serves the next request."""
    server = held_server
    aborts = metric(server, "vllm:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "messages": user(PROMPTS[1]), "max_tokens": MAX_TOKENS_LIMIT}
    server.hold.set()
    try:
        with pytest.raises(httpx.TimeoutException):
            post(server, "/v1/chat/completions", body, timeout=0.5)
        assert _wait_for_abort(server, aborts) == aborts + 1, "the timed-out generation was not stopped"
    finally:
        server.hold.clear()
    r = post(server, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# ---------------------------------------------------------------- bad input
LONG = "word " * 400  # > 256-token context window
BAD_REQUESTS = [
    # (id, path, body or raw bytes, api key, expected status, expected param or None)
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', API_KEY, 400, None),
    ("not-an-object", "/v1/chat/completions", [1, 2, 3], API_KEY, 400, None),
    ("messages-wrong-type", "/v1/chat/completions", {"messages": "hi"}, API_KEY, 400, "messages"),
    ("max-tokens-wrong-type", "/v1/chat/completions", {"messages": user("hi"), "max_tokens": "many"}, API_KEY,
     400, "max_tokens"),
    ("stream-wrong-type", "/v1/completions", {"prompt": "hi", "stream": {"a": 1}}, API_KEY, 400, "stream"),
    ("role-unknown", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, API_KEY, 400,
     None),
    ("missing-messages", "/v1/chat/completions", {"model": "tiny"}, API_KEY, 400, "messages"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 3}, API_KEY, 400, "prompt"),
    ("max-tokens-negative", "/v1/chat/completions", {"messages": user("hi"), "max_tokens": -5}, API_KEY, 400,
     "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, API_KEY, 400, "max_tokens"),
    ("max-tokens-huge", "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 10**6}, API_KEY, 400,
     "max_tokens"),
    ("max-tokens-enormous", "/v1/completions", {"prompt": "hi", "max_tokens": 10**40}, API_KEY, 400,
     "max_tokens"),
    ("temperature-negative", "/v1/chat/completions", {"messages": user("hi"), "temperature": -0.5}, API_KEY,
     400, "temperature"),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, API_KEY, 400, "top_p"),
    ("nan", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', API_KEY, 400, "temperature"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, API_KEY, 400, "messages"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, API_KEY, 400, "prompt"),
    ("prompt-over-context", "/v1/completions", {"prompt": LONG}, API_KEY, 400, "prompt"),
    ("chat-over-context", "/v1/chat/completions", {"messages": user(LONG)}, API_KEY, 400, "messages"),
    ("token-id-out-of-vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, API_KEY, 400, "prompt"),
    ("lone-surrogate", "/v1/chat/completions", {"messages": user("a\ud800b")}, API_KEY, 400, "messages"),
    ("content-wrong-type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, API_KEY, 400,
     "messages.0.content"),
    ("two-prompts", "/v1/completions", {"prompt": ["a", "b"]}, API_KEY, 400, "prompt"),
    ("n-2", "/v1/chat/completions", {"messages": user("hi"), "n": 2}, API_KEY, 400, "n"),
    ("five-stops", "/v1/completions", {"prompt": "hi", "stop": list("abcde")}, API_KEY, 400, "stop"),
    ("unknown-model", "/v1/chat/completions", {"model": "gpt-9", "messages": user("hi")}, API_KEY, 404, "model"),
    ("wrong-api-key", "/v1/chat/completions", {"messages": user("hi")}, "sk-wrong", 401, None),
    ("no-api-key", "/v1/completions", {"prompt": "hi"}, None, 401, None),
    ("wrong-key-and-bad-json", "/v1/completions", b"{", "sk-wrong", 401, None),
]


@pytest.mark.parametrize("name,path,body,key,status,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_a_json_4xx_and_server_keeps_serving(server, name, path, body, key, status, param):
    r = post(server, path, raw=body if isinstance(body, bytes) else None, body=body, key=key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if name.endswith("over-context"):
        assert err["code"] == "context_length_exceeded"
    ok = post(server, "/v1/chat/completions", {"model": "tiny", "messages": user("hi"), "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_wrong_api_key_with_openai_client(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=2)


def test_unknown_route_is_json_404(server):
    r = httpx.get(server.url + "/v1/nope", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 404 and "message" in r.json()["error"]


# ---------------------------------------------------------------- metrics
SAMPLE = re.compile(r'[a-zA-Z_:][\w:]*(\{[a-zA-Z_]\w*="[^"]*"(,[a-zA-Z_]\w*="[^"]*")*\})? [-+]?(\d+(\.\d+)?(e[-+]?\d+)?|\+Inf)')


def test_metrics_are_prometheus_text_and_count_requests(server, client):
    before = {n: metric(server, n) for n in ["vllm:spec_decode_num_drafts_total", "vllm:generation_tokens_total",
                                             "vllm:spec_decode_num_draft_tokens_total"]}
    r = client.chat.completions.create(model="tiny", messages=user("count me"), max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.fullmatch(line), line
    for name in ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:request_success_total", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds"]:
        assert f"# TYPE {name} " in text, name
    assert metric(server, "vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] == \
        r.usage.completion_tokens
    drafts = metric(server, "vllm:spec_decode_num_drafts_total") - before["vllm:spec_decode_num_drafts_total"]
    assert drafts >= 1
    draft_tokens = metric(server, "vllm:spec_decode_num_draft_tokens_total") - \
        before["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts <= draft_tokens <= 7 * drafts  # tree size 8 = root + at most 7 draft nodes per step
    assert metric(server, "vllm:e2e_request_latency_seconds_count") >= 1


def test_metrics_unit_per_position_counts():
    from treeflash.decoding.stats import Stats
    from treeflash.serve.metrics import Metrics

    m, s = Metrics("m"), Stats()
    for accepted, size in [(3, 8), (1, 8), (0, 8)]:
        s.record(accepted, size)
    s.prompt_tokens = 5
    m.record_generation(s, completion_tokens=7, finish="length", e2e_s=0.3)
    text = m.render()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 21' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4' in text
    per_pos = re.findall(r'accepted_tokens_per_pos_total\{model_name="m",position="(\d)"\} (\d+)', text)
    assert per_pos == [("0", "2"), ("1", "1"), ("2", "1")]
    assert 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="0.25"} 0' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="0.5"} 1' in text


# ---------------------------------------------------------------- stop strings (pure)
def test_text_assembler_holds_back_partial_stop_strings(engine):
    from treeflash.decoding.text import TextAssembler

    tok = engine.target.tokenizer
    ids = tok("Hello world, this is a test of stop strings.", add_special_tokens=False)["input_ids"]
    full = tok.decode(ids)
    for stop in ["is a", "s.", "world, this", "never there"]:
        ta = TextAssembler(tok, set(), [stop])
        out = ""
        for t in ids:
            out += ta.add(t)
            assert stop not in out
            if ta.stopped:
                break
        out += ta.flush()
        assert out == (full[:full.index(stop)] if stop in full else full), stop


# ---------------------------------------------------------------- fuzzing
def fuzz_openapi(url: str, seconds: float) -> list[int]:
    """Schemathesis over the server's own OpenAPI schema (valid and invalid requests on every route,
    for at most `seconds`): asserts no 5xx; returns the statuses seen."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    seen, failures = [], []
    deadline = time.time() + seconds

    for op in operations:
        for mode in GenerationMode:
            if op.method.lower() != "post" and mode == GenerationMode.NEGATIVE:
                continue  # no parameters to break

            @settings(max_examples=12 if op.method.lower() == "post" else 2, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                if time.time() > deadline:
                    return
                r = case.call(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
                seen.append(r.status_code)
                if r.status_code >= 500:
                    failures.append((op.path, case.body, r.status_code, r.text[:300]))

            fuzz()
    assert not failures, failures
    assert len(seen) >= 10 and any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
    return seen


def test_schemathesis_fuzz_finds_no_server_errors(server):
    fuzz_openapi(server.url, seconds=90)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_fault_mid_generation_is_a_500_and_the_server_keeps_serving(held_server, monkeypatch):
    """A fault while decoding (here: the sampler finds no finite logits) is the server's, not the
    request's: a JSON 500, and the next request is served."""
    import treeflash.decoding.sampling as sampling
    from treeflash.errors import TreeflashError

    real = sampling.probs

    def not_finite(logits, p):
        if p.top_p == 0.123:
            raise TreeflashError("the target's logits are not finite: nothing to sample from")
        return real(logits, p)

    monkeypatch.setattr(sampling, "probs", not_finite)
    r = post(held_server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "top_p": 0.123})
    assert r.status_code == 500 and "internal error" in r.json()["error"]["message"], r.text
    r = post(held_server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "top_p": 0.9})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


# ---------------------------------------------------------------- start-up errors
def test_serve_refuses_a_busy_port(model_dirs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "treeflash.cli", "serve", "--target", str(model_dirs[0]),
                              "--port", str(port)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: cannot listen on 127.0.0.1:") and "Traceback" not in out.stderr


def test_serve_engine_options_reach_the_engine(model_dirs):
    """--stage2-vocab reaches the engine (it was parsed and dropped): a value below --top-k is
    refused at start-up by the engine's own check, as `treeflash generate` refuses it."""
    target_dir, drafter_dir = model_dirs
    out = subprocess.run([sys.executable, "-m", "treeflash.cli", "serve", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--port", str(free_port()), "--dtype", "float32", "--top-k", "4",
                          "--stage2-vocab", "3"], capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "error: stage-2 vocabulary must be 0 or in [top-k, 49152], got 3"
