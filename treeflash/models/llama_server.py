"""One `llama-server` process (built by `make llama-cpp`) on a loopback port: started, asked for
completions as token ids, stopped. The bench's llama.cpp arms and `data regen --engine
llama-server` both run through it."""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from ..errors import TreeflashError
from . import llamacpp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server -m GGUF -np parallel` with `ctx` tokens per slot; `extra` adds flags."""

    def __init__(self, gguf: Path, threads: int, ctx: int = 4096, parallel: int = 1, extra: tuple = ()):
        self.gguf, self.threads, self.ctx, self.parallel, self.extra = gguf, threads, ctx, parallel, tuple(extra)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, ready_s: float = 120) -> "LlamaServer":
        exe = llamacpp.binary("llama-server")
        if exe is None:
            raise TreeflashError(f"llama-server is not built; {llamacpp.BUILD_HINT}")
        port = _free_port()
        cmd = [str(exe), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(self.threads),
               "-c", str(self.ctx * self.parallel), "-np", str(self.parallel), "--no-webui", *self.extra]
        # its log goes to a file: an unread pipe fills up over a long run and blocks the server
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        atexit.register(self.close)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + ready_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise TreeflashError(f"llama-server exited: {self.log_tail(400)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.close()
        raise TreeflashError(f"llama-server did not become ready in {ready_s:.0f} s")

    def complete(self, prompt_ids, n_predict: int, **body) -> dict:
        """Greedy `/completion` of token ids; the reply holds `tokens` (ending with the
        end-of-generation token that stopped it, if one did), `stop_type` and the server's own
        `timings`. A failed request is one line with the end of the server's log."""
        if self.proc is None:
            self.start()
        body = {"prompt": list(map(int, prompt_ids)), "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "return_tokens": True, "cache_prompt": False, **body}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return json.loads(r.read())
        except OSError as e:  # URLError, HTTPError, a dropped connection
            raise TreeflashError(f"llama-server failed a request ({e}): {self.log_tail()}") from None

    def log_tail(self, chars: int = 300) -> str:
        """The end of the server's log, read without moving the offset it writes at (shared)."""
        fd = self.log.fileno()
        size = os.fstat(fd).st_size
        return " ".join(os.pread(fd, chars, max(0, size - chars)).decode(errors="replace").split())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # in-flight requests end with a connection error
            self.proc.wait()
