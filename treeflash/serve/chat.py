"""`treeflash chat`: a terminal chat that streams answers and keeps multi-turn history."""
from __future__ import annotations

import sys
from typing import Callable, TextIO

from ..config import GenerationConfig
from ..decoding.stats import Stats
from ..errors import TreeflashError

HELP = "commands: /reset clears the conversation, /exit quits (so does Ctrl-D)"


class ChatSession:
    """History of chat messages; each answer is rendered by the target's chat template."""

    def __init__(self, engine, config: GenerationConfig, system: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None):
        self.engine, self.config, self.system = engine, config, system
        self.out, self.err = out or sys.stdout, err or sys.stderr  # the streams of now, not of import time
        self.history: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, user_text: str) -> str | None:
        """Stream the reply to `user_text`; returns it (None if it could not be generated)."""
        self.history.append({"role": "user", "content": user_text})
        stats, pieces = Stats(), []
        try:
            for piece in self.engine.stream(self.history, self.config, stats=stats):
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except TreeflashError as e:  # e.g. the conversation outgrew the context window
            self.history.pop()
            self._note(f"error: {e} (/reset starts over)")
            return None
        except KeyboardInterrupt:
            self._note("\n[interrupted]")
        self.out.write("\n")
        self.out.flush()
        reply = "".join(pieces)
        self.history.append({"role": "assistant", "content": reply})
        self._note(f"[tau {stats.mean_acceptance_length:.2f} | {stats.tokens_per_second:.1f} tok/s | "
                   f"{stats.new_tokens} tokens]")
        return reply

    def run(self, read_line: Callable[[], str]) -> int:
        """The read-answer loop; `read_line` raises EOFError at the end of input."""
        while True:
            try:
                line = read_line().strip()
            except EOFError:
                return 0
            except KeyboardInterrupt:
                self._note("")
                return 0
            if not line:
                continue
            if line.startswith("/") and self._command(line):
                return 0
            if not line.startswith("/"):
                self.answer(line)

    def _command(self, line: str) -> bool:
        """Handle a /command; True means quit."""
        cmd = line.split()[0].lower()
        if cmd in ("/exit", "/quit"):
            return True
        if cmd == "/reset":
            self.reset()
            self._note("[conversation cleared]")
        else:
            self._note(HELP)
        return False

    def _note(self, text: str) -> None:
        print(text, file=self.err, flush=True)


def line_reader(stream: TextIO = sys.stdin) -> Callable[[], str]:
    """input() with a prompt on a terminal; plain lines (no prompt echo) from a pipe."""
    if stream.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        return lambda: input("you> ")

    def read() -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line

    return read
