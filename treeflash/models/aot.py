"""Compiled graphs that outlive the process: AOTInductor packages on disk, built once per machine.

`torch.compile` with frozen weights (the compiled backends) recompiles in every process: inductor's
FX cache does not store graphs with prepacked weights, and AOTAutograd's cache refuses frozen
graphs. Here a module's forward is exported (`torch.export`, its varying sizes symbolic), compiled
ahead of time with the weights frozen into the shared library (`aoti_compile_and_package`), and
saved under `cache_dir()/aot/<key>/<name>.pt2`; a later process loads it in about a second.

- `Packaged`: one such callable. The first call loads the package, or builds it (minutes, with a
  notice); an entry that fails to load is rebuilt, with a one-line notice; a module the export
  cannot take runs under torch.compile in this process instead, with a one-line notice.
- `compiled_call`: what the compiled backends call for every graph they run (the target's step,
  the drafter's block pass, the TreeFlash heads): a `Packaged` on the CPU, where packages are on
  (the default; `TREEFLASH_AOT=0` turns them off), else `inductor.compile_frozen`.
- `key_dir`: the folder of one model's packages. The key covers what the compiled code depends on:
  the CPU (its features), torch, the thread count, the model (its config and a checksum of its
  weights), dtype, the C++ GEMM choice and the caller's own options (taps, shapes).
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
from typing import Callable

import torch

from .cpu import cpu_flags
from .registry import cache_dir


def enabled() -> bool:
    """Whether the compiled backends keep their graphs on disk (default on; TREEFLASH_AOT=0: off)."""
    return os.environ.get("TREEFLASH_AOT", "1") != "0"


def weights_checksum(module: torch.nn.Module) -> str:
    """A checksum of every parameter's first 4096 bytes and shape: different weights, another key."""
    crc = 0
    for name, p in module.named_parameters():
        head = p.detach().reshape(-1)[:4096 // p.element_size()].cpu().float().numpy().tobytes()
        crc = zlib.crc32(f"{name}{tuple(p.shape)}".encode() + head, crc)
    return f"{crc:08x}"


def key_dir(kind: str, module: torch.nn.Module, config: str, cpp_gemm: bool, **parts) -> Path:
    """The folder of `module`'s packages of this `kind` on this machine and torch; `config`: the
    model's configuration as text; `parts`: the caller's own options."""
    p = next(module.parameters())
    key = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "flags": sorted(cpu_flags()), "threads": torch.get_num_threads(), "config": config,
           "weights": weights_checksum(module), "dtype": str(p.dtype), "cpp_gemm": cpp_gemm, **parts}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "aot" / f"{kind}-{digest}"


def build(module: torch.nn.Module, args: tuple, shapes, path: Path, cpp_gemm: bool) -> None:
    """Export `module` on example `args` (`shapes`: torch.export's dynamic_shapes) and compile it
    into the package `path` (minutes)."""
    with torch.no_grad():
        ep = torch.export.export(module.eval(), args, dynamic_shapes=shapes, strict=False)
        options = {"freezing": True, "aot_inductor.package_constants_in_so": True}
        if cpp_gemm:
            from .inductor import compile_options

            options.update(compile_options(True))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=options)
    tmp.replace(path)  # whole or absent: another process never loads half a package


class Packaged:
    """`module`'s forward as a package at `path`, loaded or built at the first call; `example()`
    gives (args, dynamic_shapes) for the export. `what`: its name in the notices; `compile_kw`:
    torch.compile's options where the export fails."""

    def __init__(self, module: torch.nn.Module, path: Path, example: Callable[[], tuple], cpp_gemm: bool, what: str,
                 **compile_kw):
        self.module, self.path, self.example, self.cpp_gemm, self.what = module, path, example, cpp_gemm, what
        self.compile_kw = compile_kw
        self.run = None

    def __call__(self, *args):
        if self.run is None:
            self.run = self._load()
        return self.run(*args)

    def _load(self):
        if self.path.exists():
            try:
                return torch._inductor.aoti_load_package(str(self.path))
            except Exception as e:  # noqa: BLE001  (a corrupt or stale entry: rebuilt below)
                print(f"treeflash: rebuilding {self.path} ({type(e).__name__})", file=sys.stderr)
        t0 = time.perf_counter()
        print(f"treeflash: compiling {self.what} once on this machine (minutes) into {self.path.parent}",
              file=sys.stderr)
        try:
            build(self.module, *self.example(), self.path, self.cpp_gemm)
            run = torch._inductor.aoti_load_package(str(self.path))
        except Exception as e:  # noqa: BLE001  (a model the export cannot take: compiled in process)
            print(f"treeflash: no package for {self.what} ({type(e).__name__}: {str(e)[:120]}); "
                  "compiling in this process instead", file=sys.stderr)
            return in_process(self.module, self.cpp_gemm, **self.compile_kw)
        print(f"treeflash: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return run


def in_process(module: torch.nn.Module, cpp_gemm: bool, **compile_kw):
    """The module's forward under torch.compile in this process (as with TREEFLASH_AOT=0)."""
    from .inductor import compile_frozen

    return compile_frozen(module.forward, cpp_gemm, **compile_kw)


def compiled_call(module: torch.nn.Module, path: Callable[[], Path], example: Callable[[], tuple],
                  cpp_gemm: bool, what: str, **compile_kw):
    """`module.forward` compiled with its weights frozen: a package on disk where packages are on
    and the module is on the CPU (`path()`: its file; `example()`: export args and dynamic shapes),
    else torch.compile in this process (`compile_kw`: its options)."""
    if enabled() and next(module.parameters()).device.type == "cpu":
        return Packaged(module, path(), example, cpp_gemm, what, **compile_kw)
    return in_process(module, cpp_gemm, **compile_kw)
