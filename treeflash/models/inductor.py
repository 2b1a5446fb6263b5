"""torch.compile (inductor) for the target's steps and the drafter's passes, with frozen weights.

- `compile_frozen`: compile a bound method of a module whose weights become graph constants;
- `compile_options`, `cpp_gemm_supported`: the `compiled-cpp` backend (every matmul in inductor's
  C++ GEMM template) and whether this CPU can run it.

Two functions here reach past torch's public API; a torch upgrade may need them revisited:
- `skip_guards_through_self` is a dynamo `guard_filter_fn`: it reads guard entries' source names
  (`self...`), a format dynamo does not promise;
- `avoid_spilling_micro_gemm` edits inductor's private table of C++ micro-GEMM configurations
  (`torch._inductor.codegen.cpp_micro_gemm.micro_gemm_configs`), once per process; it does nothing
  (returns False) where that table has another shape.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch


@functools.cache
def cpp_gemm_supported() -> bool:
    """Whether inductor's C++ GEMM template can run here (an AVX2 or AVX-512 x86 CPU)."""
    from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa

    return isinstance(pick_vec_isa(), (VecAVX2, VecAVX512))  # AMX machines are AVX-512 ones


def compile_options(cpp_gemm: bool) -> dict | None:
    """torch.compile options: with `cpp_gemm`, every matmul in inductor's C++ GEMM template (max-autotune
    with the CPP backend as the only choice, so nothing is benchmarked)."""
    if not cpp_gemm:
        return None
    avoid_spilling_micro_gemm()
    return {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


# a guard whose source is reached through `self` (its attributes, modules, parameters, class)
_THROUGH_SELF = re.compile(r"(?<![\w'\"])self\b")


def skip_guards_through_self(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn` for a compiled bound method: keep the guards on its
    arguments and on global state, drop those reached through `self`. A frozen graph has its
    weights folded in, so guarding them is moot. A compiled target step has thousands of guards,
    nearly all through `self`; dropping them removes most of dynamo's per-call overhead
    (docs/performance.md, "Guards only on a compiled step's arguments"). Safe only with
    `isolate_recompiles` (see `compile_frozen`): otherwise another instance's call would find this
    instance's graph."""
    return [not _THROUGH_SELF.search(e.name) for e in entries]


def compile_frozen(method, cpp_gemm: bool = False, **kwargs):
    """torch.compile a bound method of a module whose weights become graph constants (inductor's
    freezing). The compiled function keeps its own cache entries (`isolate_recompiles`), so it never
    runs a graph compiled for another instance (another model's weights), and it guards only its
    arguments (`skip_guards_through_self`). `cpp_gemm`: see `compile_options`."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    options = {**(compile_options(cpp_gemm) or {}), "guard_filter_fn": skip_guards_through_self}
    return torch.compile(method, options=options, isolate_recompiles=True, **kwargs)


def _rows_not_multiple_of_4(config, m, n, k, *args, **kwargs) -> bool:
    return m % 4 != 0


@functools.cache
def avoid_spilling_micro_gemm() -> bool:
    """Inductor's AVX2 micro-GEMM for bf16 inputs blocks 4 rows x 24 columns wherever it can: 12
    accumulators, 3 converted weight vectors and the broadcast row fill all 16 registers, so with 4
    (or 8, ...) rows it spills and runs at half the speed of 3 rows (docs/performance.md, "The
    micro-GEMM's register block"). Keep that block where the rows are not a multiple of 4 (1-3: it
    is the fastest there); elsewhere the next choice, 4 x 16, wins. Changes inductor's (private)
    table of micro-kernel configurations, once per process; False where it has another shape."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (imported first: the codegen modules import it)
        from torch._inductor.codegen import cpp_micro_gemm
        from torch._inductor.cpu_vec_isa import VecAVX2
    except ImportError:
        return False
    done = False
    for configs in getattr(cpp_micro_gemm, "micro_gemm_configs", {}).values():
        for i, c in enumerate(configs):
            if (getattr(c, "vec_isa_cls", None) is VecAVX2 and c.input_dtype == c.input2_dtype == torch.bfloat16
                    and tuple(c.register_blocking) == (4, 24, 1) and c.extra_check is None):
                configs[i], done = dataclasses.replace(c, extra_check=_rows_not_multiple_of_4), True
    return done
