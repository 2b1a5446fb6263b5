"""Our drafter inside the real llama.cpp: `treeflash export --format gguf`, then llama.cpp's own
`llama-speculative-simple --spec-type draft-dflash` on SmolLM2 (Llama) and Qwen2.5-Coder (Qwen2) targets.

The export is faithful when llama.cpp accepts about as many of its drafts as our engine's `chain`
method accepts of the same drafter's (same prompts, same bf16 target weights, greedy): layer ids,
RoPE, norms and the mask token all have to agree for that. Skipped where the binaries are absent.
"""
import json
import subprocess
import sys

import pytest

from treeflash.models import llamacpp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(llamacpp.binary("llama-speculative-simple") is None or llamacpp.source_dir() is None,
                       reason="llama.cpp is not built here: run `make llama-cpp`"),
]

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colours are"]
N = 48


def _available(target: str) -> bool:
    from treeflash.errors import TreeflashError
    from treeflash.models import registry

    try:
        registry.resolve_target(target)
    except TreeflashError:
        return False
    return True


# SmolLM2 (Llama) and Qwen2.5-Coder (Qwen2, 152k vocabulary); both shipped drafters have a draft
# vocabulary, which the GGUF must carry (llama.cpp otherwise drafts from the whole vocabulary)
@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def ggufs(request, tmp_path_factory):
    target = request.param
    if not _available(target):
        pytest.skip(f"{target} is not installed here")
    out = tmp_path_factory.mktemp("gguf")
    r = subprocess.run([sys.executable, "-m", "treeflash", "export", "--format", "gguf", "--target", target,
                        str(out / "draft.gguf")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "DFlash body" in r.stderr  # the one line saying what the GGUF carries
    return target, llamacpp.target_gguf(target, out / "target-bf16.gguf"), out / "draft.gguf"


def test_export_refuses_a_non_gguf_name(tmp_path):
    r = subprocess.run([sys.executable, "-m", "treeflash", "export", "--format", "gguf", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 2 and "give OUT a .gguf name" in r.stderr


def test_llama_cpp_accepts_our_drafter_as_our_chain_method_does(ggufs):
    import treeflash

    name, target, draft = ggufs
    engine = treeflash.load(target=name, dtype="bfloat16", backend="static")
    theirs = ours_acc = ours_steps = 0
    theirs_steps = 0
    for p in PROMPTS:
        run = llamacpp.speculative_simple(target, draft, p, N, draft_max=engine.drafter.block_size - 1)
        theirs += run.n_accept
        theirs_steps += run.steps
        r = engine.generate(p, method="chain", tree_size=engine.drafter.block_size, max_new_tokens=N, chat=False,
                            ignore_eos=True)
        ours_acc += sum(r.stats.acceptance_lengths) - r.stats.steps
        ours_steps += r.stats.steps
    # accepted drafts per step (tau - 1): a drafter that llama.cpp reads wrongly accepts ~0
    acc_theirs, acc_ours = theirs / theirs_steps, ours_acc / ours_steps
    print(json.dumps({"accepted_per_step_llama_cpp": acc_theirs, "accepted_per_step_ours_chain": acc_ours}))
    assert acc_ours > 0.2, "our chain method should accept drafts here: the comparison must bite"
    # one-sided: a misread export accepts far fewer; more than ours is the two bf16 stacks' texts
    # drifting apart over 48 greedy tokens (Qwen: 0.47 against 0.31 here), not a misreading
    assert acc_theirs >= 0.65 * acc_ours, (acc_theirs, acc_ours)


def test_bench_arms_in_llama_server_count_tokens_and_steps(tmp_path):
    """`llama-cpp-dflash` (our drafter in llama-server) beside its plain bf16 decoding: token ids in and
    out, every generated token accounted for by the prompt pass or a step."""
    import treeflash
    from treeflash.bench import llama_server
    from treeflash.config import GenerationConfig

    engine = treeflash.load(drafter="none", dtype="float32")
    ids = engine.target.encode(PROMPTS[0], chat=False)
    arms = []
    for name in ("llama-cpp-bf16", "llama-cpp-dflash"):
        got, why = llama_server.build(name, "smollm2-135m", [4], 2, tmp_path)
        assert not why
        arms += got
    try:
        outs = [arm.generate(ids, GenerationConfig(max_new_tokens=32, seed=0)) for arm in arms]
    finally:
        for arm in arms:
            arm.close()
    for out in outs:
        assert 0 < len(out.token_ids) <= 32 and out.stats.total_s > 0
        assert sum(out.stats.acceptance_lengths) + 1 == len(out.token_ids)
    assert outs[0].stats.mean_acceptance_length == 1.0 and outs[1].stats.mean_acceptance_length > 1.0


LLAMA_AFTER_TORCH = r"""
import sys
import torch
from treeflash.bench.methods import llama_cpp_gguf
from treeflash.bench.selftest import tiny_target

gguf, why = llama_cpp_gguf("smollm2-135m")
assert gguf is not None, why
if sys.argv[1] == "torch-first":  # a compiled bf16 step of 4 rows on PyTorch's OpenMP threads first
    target = tiny_target("llama", dtype=torch.bfloat16).set_backend("compiled")
    cache = target.new_cache(64)
    target.forward(torch.arange(8), torch.arange(8), cache)
    target.forward(torch.arange(4), 8 + torch.arange(4), cache, torch.ones(4, 4, dtype=torch.bool).tril_())
import llama_cpp
llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=2, verbose=False)
prompt = llm.tokenize(b"def fibonacci(n):\n    ")  # several tokens: one forward over all of them
out = []
for tok in llm.generate(prompt, reset=True, temp=0.0, top_k=1):
    out.append(int(tok))
    if len(out) == 12:
        break
print(len(prompt), *out)
"""


def test_llama_cpp_decodes_a_prompt_after_a_compiled_torch_step_in_one_process():
    """ggml's AMX kernels share PyTorch's OpenMP threads in one process (`make llama-cpp` patches
    them to load their tile configuration at every call): a several-token prompt decodes there,
    after a compiled bf16 PyTorch step, as it does in a process that runs llama.cpp alone."""
    from treeflash.bench.methods import llama_cpp_gguf

    if llama_cpp_gguf("smollm2-135m")[0] is None:
        pytest.skip("llama_cpp or the SmolLM2 GGUF is not available here")
    env = {**__import__("os").environ, "TREEFLASH_AOT": "0"}
    runs = [subprocess.run([sys.executable, "-c", LLAMA_AFTER_TORCH, order], capture_output=True, text=True,
                           timeout=900, env=env) for order in ("alone", "torch-first")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    alone, after = (r.stdout.split() for r in runs)
    assert int(alone[0]) >= 4 and len(alone) == 13
    assert after == alone
