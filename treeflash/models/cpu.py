"""What this machine's CPU computes fast: its feature flags, and where bf16 work pays to upcast.

Long flat sequences (a prefill of >= `UPCAST_MIN_ROWS` tokens) of a bfloat16 model on a CPU
without AMX compute in float32 from the bf16 weights (upcast per matmul) and store bf16 keys and
values: there bf16 matmuls with many rows run slower than float32 ones (docs/performance.md,
"dtype: `auto`, bf16 and float32"). The target's fast path (`fastpath.FastPath`) and the drafter's
context pass (`drafter.Drafter.context_kv`) both follow `upcast_pays`, so every method shares one
prefill.
"""
from __future__ import annotations

import functools

import torch

UPCAST_MIN_ROWS = 64  # flat sequences at least this long compute in float32 (see above)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return frozenset()


def upcast_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 weights on a CPU without AMX: long matmuls are faster upcast to float32."""
    return dtype == torch.bfloat16 and device.type == "cpu" and bool(cpu_flags()) and "amx_bf16" not in cpu_flags()
