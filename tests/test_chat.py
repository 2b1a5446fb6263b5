"""`treeflash chat`: streaming answers, multi-turn history, /reset, /exit and EOF.

The subprocess tests drive the real command through stdin; the expected answers come from the
same tiny model in-process (greedy, so they are exact).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

MAX_NEW = 8
SPEC = dict(method="treeflash", tree_size=8, top_m=2, top_k=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from test_serve import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def engine(model_dirs):
    from treeflash.api import Engine
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target

    return Engine(Target.load(str(model_dirs[0])), load_drafter(model_dirs[1]))


def streamed(engine, messages: list[dict], n: int = MAX_NEW) -> str:
    """What the chat shows for this conversation: the engine's stream, joined."""
    return "".join(engine.stream(messages, max_new_tokens=n, temperature=0.0, **SPEC))


SESSIONS = {
    "reset-exit": "Hi there\n\nTell me more\n/reset\nHi there\n/exit\nnever answered\n",
    "eof": "Hello\n/unknown\n",  # no /exit: stdin just ends (Ctrl-D)
}


@pytest.fixture(scope="module")
def chat_runs(model_dirs) -> dict[str, tuple[int, str, str]]:
    """Run `treeflash chat` once per scripted stdin (in parallel); name -> (rc, stdout, stderr)."""
    target_dir, drafter_dir = model_dirs
    cmd = [sys.executable, "-m", "treeflash.cli", "chat", "--target", str(target_dir), "--drafter",
           str(drafter_dir), "--max-new-tokens", str(MAX_NEW), "--tree-size", "8", "--top-m", "2", "--top-k", "2", "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}
    procs = {name: subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env) for name in SESSIONS}
    runs = {}
    for name, proc in procs.items():
        # bytes, not text: answers of a random model may hold "\r", which text mode would rewrite
        out, err = proc.communicate(SESSIONS[name].encode(), timeout=300)
        runs[name] = (proc.returncode, out.decode("utf-8"), err.decode("utf-8"))
    return runs


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_chat_history_reset_and_exit_through_stdin(chat_runs, engine):
    rc, out, err = chat_runs["reset-exit"]
    assert rc == 0, err
    a1 = streamed(engine, [user("Hi there")])
    a2 = streamed(engine, [user("Hi there"), assistant(a1), user("Tell me more")])
    assert a2 != streamed(engine, [user("Tell me more")]), "the second turn must see the first"
    # the third answer follows /reset: the same as the first; nothing is answered after /exit
    assert out == f"{a1}\n{a2}\n{a1}\n"
    assert err.count("[tau ") == 3 and err.count(" tok/s") == 3
    assert "[conversation cleared]" in err and "Traceback" not in err


def test_chat_ends_cleanly_on_eof(chat_runs, engine):
    rc, out, err = chat_runs["eof"]
    assert rc == 0, err
    assert out == streamed(engine, [user("Hello")]) + "\n"
    assert "/reset" in err.split("[tau", 1)[1], "an unknown command should print the help"
    assert "Traceback" not in err


# ---------------------------------------------------------------- in-process session
def make_session(engine, system=None):
    from treeflash.serve.chat import ChatSession

    out, err = io.StringIO(newline=""), io.StringIO()
    from treeflash.config import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0, **SPEC)
    return ChatSession(engine, cfg, system=system, out=out, err=err), out, err


def lines(*items):
    it = iter(items)

    def read():
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_session_keeps_history_with_a_system_message(engine):
    s, out, _ = make_session(engine, system="You are terse.")
    assert s.run(lines("One", "Two", "/exit", "Three")) == 0
    sys_msg = {"role": "system", "content": "You are terse."}
    a1 = streamed(engine, [sys_msg, user("One")])
    a2 = streamed(engine, [sys_msg, user("One"), assistant(a1), user("Two")])
    assert s.history == [sys_msg, user("One"), assistant(a1), user("Two"), assistant(a2)]
    assert out.getvalue() == f"{a1}\n{a2}\n"
    s.reset()
    assert s.history == [sys_msg]


def test_session_survives_a_conversation_over_the_context_window(engine):
    s, out, err = make_session(engine)
    long = "word " * 400  # the tiny target's context window is 256 tokens
    assert s.answer(long) is None
    assert "error:" in err.getvalue() and "context window" in err.getvalue()
    assert s.history == [] and out.getvalue() == ""
    assert s.answer("Hi there") == streamed(engine, [user("Hi there")])


def test_session_interrupt_keeps_partial_answer(engine, monkeypatch):
    s, out, err = make_session(engine)
    real = engine.stream

    def interrupted(*a, **kw):
        gen = real(*a, **kw)
        yield next(gen)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "stream", interrupted)
    first = s.answer("Hi there")
    assert first == out.getvalue().rstrip("\n") and "[interrupted]" in err.getvalue()
    assert s.history[-1] == assistant(first)
