"""Compiled target steps that outlive the process: one AOTInductor package per tree bucket, on disk.

`torch.compile` with frozen weights (the compiled backends) recompiles in every process: inductor's
FX cache does not store graphs with prepacked weights, and AOTAutograd's cache refuses frozen
graphs. Here `FastPath._step` for one bucket is exported (`torch.export`, the attended width and
the cache's capacity symbolic), compiled ahead of time with the weights frozen into the shared
library (`aoti_compile_and_package`), and saved under `cache_dir()/aot/<key>/`. A later process
loads the package in seconds. The key covers what the compiled code depends on: the CPU, torch,
the target (its config and a checksum of its weights), dtype, the C++ GEMM choice, the tapped
layers and the bucket. An entry that fails to load is rebuilt, with a one-line notice.

Switched on by `TREEFLASH_AOT=1` for the compiled backends (docs/performance.md, "Compiled steps
on disk"); the drafter's passes are still compiled in each process.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path

import torch

from .cpu import cpu_flags
from .kvcache import StaticKV
from .registry import cache_dir

MIN_WIDTH, MIN_SLOTS = 8, 64  # the exported graph's lower bounds of the mask width and the cache capacity


def enabled() -> bool:
    """Whether compiled backends use packages on disk (TREEFLASH_AOT=1)."""
    return os.environ.get("TREEFLASH_AOT", "0") == "1"


def weights_checksum(model) -> str:
    """A checksum of every parameter's first 4096 bytes and shape: different weights, another key."""
    crc = 0
    for name, p in model.named_parameters():
        head = p.detach().reshape(-1)[:4096 // p.element_size()].cpu().float().numpy().tobytes()
        crc = zlib.crc32(f"{name}{tuple(p.shape)}".encode() + head, crc)
    return f"{crc:08x}"


def package_dir(model, cpp_gemm: bool, taps: tuple) -> Path:
    """The folder of this model's step packages on this machine and torch."""
    parts = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
             "flags": sorted(cpu_flags()), "threads": torch.get_num_threads(),
             "config": model.config.to_json_string(use_diff=False), "weights": weights_checksum(model),
             "dtype": str(next(model.parameters()).dtype), "cpp_gemm": cpp_gemm, "taps": list(taps)}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "aot" / key


def flat_cache(kv) -> StaticKV:
    """A StaticKV over the per-layer tensors k_0..k_L-1, v_0..v_L-1 (a step's flat arguments)."""
    layers = len(kv) // 2
    cache = StaticKV.__new__(StaticKV)
    cache.k, cache.v, cache.length = list(kv[:layers]), list(kv[layers:]), 0
    return cache


class StepModule(torch.nn.Module):
    """`FastPath._step` with the cache as flat tensors: forward(ids, pos, slots, mask, *k, *v)."""

    def __init__(self, fastpath, taps: tuple):
        super().__init__()
        self.fastpath, self.model, self.taps = fastpath, fastpath.model, taps

    def forward(self, ids, pos, slots, mask, *kv):
        return self.fastpath._step(ids, pos, slots, mask, flat_cache(kv), self.taps)


def example_inputs(fastpath, bucket: int) -> tuple:
    """Inputs of the export's trace: a chain of `bucket` rows after 64 cached slots."""
    p = next(fastpath.model.parameters())
    cap, start = 4 * MIN_SLOTS, MIN_SLOTS
    kv = [torch.zeros(1, fastpath.n_kv, cap, fastpath.head_dim, dtype=p.dtype, device=p.device)
          for _ in range(2 * len(fastpath.decoder.layers))]
    mask = torch.zeros(bucket, 2 * MIN_SLOTS, dtype=torch.bool, device=p.device)
    mask[:, :start + bucket] = True
    pos = torch.arange(start, start + bucket, device=p.device)
    return (torch.zeros(bucket, dtype=torch.long, device=p.device), pos, pos.clone(), mask, *kv)


@torch.no_grad()
def build(fastpath, taps: tuple, bucket: int, path: Path) -> None:
    """Export and compile the step of one bucket into `path` (minutes)."""
    from torch.export import Dim

    width, slots = Dim("width", min=MIN_WIDTH, max=1 << 20), Dim("slots", min=MIN_SLOTS, max=1 << 20)
    layers = len(fastpath.decoder.layers)
    shapes = (None, None, None, {1: width}, tuple({2: slots} for _ in range(2 * layers)))
    ep = torch.export.export(StepModule(fastpath, taps).eval(), example_inputs(fastpath, bucket),
                             dynamic_shapes=shapes, strict=False)
    options = {"freezing": True, "aot_inductor.package_constants_in_so": True}
    if fastpath.cpp_gemm:
        from .inductor import compile_options

        options.update(compile_options(True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=options)
    tmp.replace(path)  # whole or absent: another process never loads half a package


class PackagedSteps:
    """The compiled step of each bucket, loaded from disk or built there first; called as
    `FastPath._compiled_step(taps)` is: (ids, pos, slots, mask, cache, taps) -> (logits, features)."""

    def __init__(self, fastpath, taps: tuple):
        self.fastpath, self.taps = fastpath, taps
        self.dir = package_dir(fastpath.model, fastpath.cpp_gemm, taps)
        self.runners: dict[int, object] = {}
        self._in_process = None  # `in_process`, built at the first bucket without a package

    def runner(self, bucket: int):
        if bucket not in self.runners:
            path = self.dir / f"step-{bucket}.pt2"
            if path.exists():
                try:
                    self.runners[bucket] = torch._inductor.aoti_load_package(str(path))
                    return self.runners[bucket]
                except Exception as e:  # noqa: BLE001  (a corrupt or stale entry: rebuilt below)
                    print(f"treeflash: rebuilding {path} ({type(e).__name__})", file=sys.stderr)
            t0 = time.perf_counter()
            print(f"treeflash: compiling the target step for {bucket}-node trees once on this machine "
                  f"(minutes) into {self.dir}", file=sys.stderr)
            try:
                build(self.fastpath, self.taps, bucket, path)
                self.runners[bucket] = torch._inductor.aoti_load_package(str(path))
                print(f"treeflash: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            except Exception as e:  # noqa: BLE001  (a model the export cannot take: compiled in-process)
                print(f"treeflash: no package for this target ({type(e).__name__}: {str(e)[:120]}); "
                      "compiling in this process instead", file=sys.stderr)
                self.runners[bucket] = self.in_process()
        return self.runners[bucket]

    def in_process(self):
        """The step under torch.compile in this process (as without TREEFLASH_AOT): one compiled
        function for every bucket that has no package."""
        if self._in_process is None:
            from .inductor import compile_frozen

            step = compile_frozen(self.fastpath._step, self.fastpath.cpp_gemm, dynamic=False, fullgraph=True)
            self._in_process = lambda ids, pos, slots, mask, *kv: step(ids, pos, slots, mask, flat_cache(kv), self.taps)
        return self._in_process

    def __call__(self, ids, pos, slots, mask, cache: StaticKV, taps: tuple):
        return self.runner(len(ids))(ids, pos, slots, mask, *cache.k, *cache.v)
