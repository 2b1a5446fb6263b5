"""Bench arms that run in llama.cpp's own server (`make llama-cpp`), token ids in and out:

- `llama-cpp-bf16`: plain decoding of the target as a bf16 GGUF (converted from our safetensors);
- `llama-cpp-dflash`: the same target with our drafter inside llama.cpp (`--spec-type draft-dflash`,
  exported by `treeflash export --format gguf`); its budget (`--tree-size B`) is a chain of B - 1
  drafts, so B nodes are verified per step as in our methods;
- `llama-cpp-dflash-q4`: our drafter with the shipped Q4_1 target GGUF.

One `llama-server` per arm (`models/llama_server.py`), started on first use and stopped at exit. Times are
the server's own (prompt + generation, `timings`), so HTTP adds nothing.
"""
from __future__ import annotations

from pathlib import Path

from ..decoding.stats import Stats
from ..models import llamacpp, registry
from ..models.llama_server import LlamaServer
from .arms import Generation, Method

PLAIN = ("llama-cpp-bf16",)  # the arms without a drafter (arms.LLAMA_SERVER_METHODS lists them all)


class LlamaServerMethod(Method):
    def __init__(self, name: str, target_gguf: Path, draft_gguf: Path | None, budget: int | None, threads: int):
        self.name, self.tree_size = name, budget
        extra = ()
        if draft_gguf is not None:
            extra = ("-md", str(draft_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(budget - 1),
                     "-td", str(threads))
        self.server = LlamaServer(target_gguf, threads, extra=extra)

    def close(self) -> None:
        self.server.close()

    def generate(self, prompt_ids, p):
        res = self.server.complete(prompt_ids, p.max_new_tokens, seed=p.seed or 0)
        tokens = [int(t) for t in res.get("tokens", [])]
        t = res["timings"]
        stats = Stats(prompt_tokens=len(prompt_ids))
        stats.total_s = (t["prompt_ms"] + t["predicted_ms"]) / 1e3
        stats.prefill_s = t["prompt_ms"] / 1e3
        stats.new_tokens = len(tokens)
        # the first token comes from the prompt pass; every later step adds its accepted drafts + 1.
        # The server reports totals only: the steps get the mean (tau is exact), and per-position
        # acceptance is not known, so it is left empty rather than made up.
        left, accepted = max(0, len(tokens) - 1), int(t.get("draft_n_accepted", 0))
        steps = max(0, left - accepted)
        for i in range(steps):
            stats.record(accepted // steps + (i < accepted % steps), self.tree_size or 1)
        stats.accepted_per_position, stats.node_hits = [], []
        stats.finish_reason = "stop" if res.get("stop_type") in ("eos", "word") else "length"
        return Generation(tokens, stats)


def build(name: str, target_name: str, budgets: list[int], threads: int | None, work: Path) -> tuple[list, str]:
    """The arms of one llama.cpp server method (one per budget for the DFlash ones), or a skip note."""
    if llamacpp.binary("llama-server") is None or llamacpp.source_dir() is None:
        return [], f"{name} skipped: llama.cpp is not built here (run `make llama-cpp`)"
    if target_name not in registry.TARGETS:
        return [], f"{name} skipped: needs a built-in target (its GGUF and safetensors), got {target_name!r}"
    threads = threads or 2
    work.mkdir(parents=True, exist_ok=True)
    if name == "llama-cpp-dflash-q4":
        target = registry.gguf_path(target_name)
    else:
        target = llamacpp.target_gguf(target_name, work / f"{target_name}-bf16.gguf")
    if name in PLAIN:
        return [LlamaServerMethod(name, target, None, None, threads)], ""
    draft = work / f"{target_name}-drafter-{_drafter_key(target_name)}.gguf"
    if not draft.exists():
        from ..models.export import drafter_to_export

        llamacpp.export_gguf(drafter_to_export(None, target_name), draft, target_name)
    return [LlamaServerMethod(name, target, draft, b, threads) for b in budgets if b >= 2], ""


GGUF_EXPORT_VERSION = "2"  # bump when export_gguf writes something else (2: the draft vocabulary as d2t)


def _drafter_key(target_name: str) -> str:
    """A short key of the shipped drafter's files and the export's version, so that a cached GGUF
    is exported again when either changes."""
    import hashlib

    path = registry.resolve_drafter(None, target_name)
    h = hashlib.sha1(GGUF_EXPORT_VERSION.encode())
    if path is not None:
        for f in sorted(path.glob("*")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        h.update((path / "config.json").read_bytes())
    return h.hexdigest()[:10]
